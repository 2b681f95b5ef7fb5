"""What a run will cost before it runs: memory plans, FLOP ratios, and the default memory settings chosen from them."""
