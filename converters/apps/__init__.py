"""The applications built on the conversion core: the command line, batch conversion (local workers or Ray),
`verify` with the runtimes that judge an output by its logits, and the batch report's plot. They import the
core (converters/) and reach formats through its registry; the core never imports them."""
