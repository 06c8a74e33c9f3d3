"""What runs in the main process: the record of each worker, the consumer, the outlet, the processes."""
