"""An example third-party backend plugin for dispatch."""
