"""Fault-free pipeline schedules (GPipe, 1F1B, 1F1B-decoupled, ZB-H1)."""
