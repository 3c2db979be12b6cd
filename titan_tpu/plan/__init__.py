"""Know before you launch: per-chip memory and step-time estimates for a config on a slice."""
