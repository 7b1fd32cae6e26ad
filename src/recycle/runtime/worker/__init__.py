"""The worker process: builds its stage and data, runs the plan's actions through its executor over a generation's
transport, and leaves a broken generation."""
