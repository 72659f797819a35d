"""The PyTorch backend: its Backend object and printer, the runtime helpers its modules copy (arrays, the
autograd Function, pages of keys), and the drop-in nn.Modules' runtime."""
