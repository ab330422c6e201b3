"""HuggingFace checkpoint import/export, upcycling to mHC + MTP, and tokenizers."""
