"""Generated modules: schedule, passes, row blocks, backend printers, and rendering into files."""
