"""dsv3: a small, fast, pure-PyTorch DeepSeek-V3 pretraining trainer."""
