"""What an object in the pool is: its name (keys: namespaces, block ids, storage ranks), its
byte layout (layout, ranges), its header, and what lets a reader trust it (seal: tags and MACs;
encryption; tenant_key: the secret and its subkeys); fingerprint: what identifies a model's KV.
Definitions above the store (keys name store objects): no threads, no engine, no connector."""
