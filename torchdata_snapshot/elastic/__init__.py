"""Elastic resume (optional): a checkpoint resumed with another number of workers or ranks."""
