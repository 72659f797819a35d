"""The JAX backend: its Backend object and printer, and the runtime helpers its modules copy (jit-friendly
blocks, custom_vjp and custom_jvp)."""
