"""The model code. Importing it caps oneDNN's primitive caches first (engine/model/onednn.py): every model
forward runs after this package is imported."""

from engine.model.onednn import cap_primitive_caches

cap_primitive_caches()
