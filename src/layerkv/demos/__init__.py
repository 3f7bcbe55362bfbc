"""The demos `layerkv demo` runs: the reference engine's producer and consumer over the pool
(demo), and the data path alone, layer by layer (datapath)."""
