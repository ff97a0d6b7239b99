"""Training: sharded parameter initialisation, the jitted step, and the loop."""
