"""The data plane: backends (the seam the runtime calls), algorithms over transports, byte transports."""
