"""The fleet: cluster files, the WAN, the planner's speed and memory models, and the emulated clock."""
