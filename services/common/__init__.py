"""What every service may share: errors, sampling parameters, the tokenizer (no torch here)."""
