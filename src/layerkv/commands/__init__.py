"""Sub-commands of the `layerkv` CLI; each module: add_parser(subparsers) -> sets args.func."""
