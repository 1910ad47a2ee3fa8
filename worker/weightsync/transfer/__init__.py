"""One version across the wire, on top of a transport: the trainer side runs the send pipeline
(cast and checksum the next bucket while the current one is on the wire), the inference side
receives into staging, verifies and hands the version over whole; delta versions send only what
changed. Nothing here knows how ranks found each other (rendezvous) or what a pod is (roles)."""
