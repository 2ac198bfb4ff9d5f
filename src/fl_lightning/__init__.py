"""Resource-heterogeneous federated learning on Lightning Fabric."""

__version__ = "0.1.0"
