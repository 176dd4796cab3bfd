"""modelwright: measured efficiency techniques and scaling for training on one GPU and many."""
