"""Small shared types and pure functions used by more than one layer (a leaf: imports nothing of disteval
except ``disteval.errors``). Layers that must not import each other (data, metrics, comm) meet here."""
