"""One folder per checkpoint format (formats/<name>/: its reader, writer, scheme table and checker family, its
layout facts and quirks); each registers itself in converters.registry when imported, and the registry imports
every folder here. formats/common/ holds what several formats share and registers no format."""
