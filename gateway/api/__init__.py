"""One module per HTTP surface."""
