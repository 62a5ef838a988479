"""One module per checkpoint format; each registers its reader and writer in converters.registry."""
