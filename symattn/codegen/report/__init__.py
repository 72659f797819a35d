"""Reports on schedules: their cost (FLOPs, arrays, memory) and their dataflow picture."""
