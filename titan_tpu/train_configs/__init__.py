"""The shipped run configs: a package so that they install with titan_tpu (pyproject.toml's
package-data) and the config loader finds them wherever the package is installed."""
