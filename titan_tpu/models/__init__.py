"""Model families, one folder each, found by name through the registry (registry.py); shared layers
in common/. Importing this package loads no family and no torch: import each name from its module."""
