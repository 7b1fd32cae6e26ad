"""The adaptive planner: failure normalization, heuristic and exact (CP-SAT) schedulers, lower bound, plan store."""
