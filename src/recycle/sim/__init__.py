"""Timing simulation of plans on a cost model."""
