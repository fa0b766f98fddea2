"""Loading and patching Hugging Face models: presets, the catalog, LoRA, export."""
