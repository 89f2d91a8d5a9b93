"""`python -m distlion.methods`: print the method table the README carries (rendered from the registry)."""

from distlion.methods import method_table

print(method_table(), end="")
