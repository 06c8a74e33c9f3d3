"""How items and messages travel between processes: pickling, pipes, batches, the outbox thread."""
