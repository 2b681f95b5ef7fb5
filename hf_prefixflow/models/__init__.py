"""What PrefixFlow can train exactly: a model's structure checked, a tiny copy probed, image-text prompts adapted."""
