"""Kernel families with their Python wrappers.  Importing a module registers its family."""
from .vector_add import VectorAddConfig, vector_add
from .elementwise import ElementwiseConfig, ElementwiseFunction, elementwise

__all__ = ["vector_add", "VectorAddConfig", "elementwise", "ElementwiseConfig", "ElementwiseFunction"]
