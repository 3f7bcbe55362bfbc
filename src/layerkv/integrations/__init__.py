"""Engine integrations: thin facades that translate an engine's connector API into layerkv's
engine-neutral hooks (`layerkv.connector.hooks`). Each submodule is the only importer of its engine."""
