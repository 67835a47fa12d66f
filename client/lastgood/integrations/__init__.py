"""Integrations with the frameworks users train with, one module each (Lightning, Hugging
Face Trainer and Accelerate, torchtitan, DeepSpeed). Each imports its framework only when
used; none imports another."""
