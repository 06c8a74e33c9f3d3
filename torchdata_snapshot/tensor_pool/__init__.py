"""The tensor pool (optional): recycled shared memory for the tensors of items."""
