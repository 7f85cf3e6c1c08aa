"""An example third-party kvsieve selector package."""
