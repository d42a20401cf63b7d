"""Prints every device the daemon serves and its attributes (PyCUDA's dump_properties.py)."""
import gpurpc.driver as drv

drv.init()
print(f"{drv.Device.count()} device(s) found; CUDA driver {drv.get_driver_version()}")
for ordinal in range(drv.Device.count()):
    dev = drv.Device(ordinal)
    print(f"Device #{ordinal}: {dev.name()}")
    print(f"  Compute Capability: {'%d.%d' % dev.compute_capability()}")
    print(f"  Total Memory: {dev.total_memory() // 1024} KB")
    print(f"  PCI bus id: {dev.pci_bus_id() or '(none)'}")
    attributes = sorted(dev.get_attributes().items(), key=lambda kv: int(kv[0]))
    for attribute, value in attributes:
        name = attribute.name if hasattr(attribute, "name") else f"attribute {attribute}"
        print(f"  {name}: {value}")
