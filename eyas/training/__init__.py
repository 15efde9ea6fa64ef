"""Training the EAGLE-3 head: training-time test (TTT), data, schedule, the trainer loop."""
