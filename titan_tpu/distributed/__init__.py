"""Process groups, meshes and the ways a model is spread over them."""
