"""The gateway: several workers behind one KServe V2 endpoint (docs/gateway.md).

``upstream`` (the HTTP/2 client of one worker), ``router`` (which worker serves a request),
``placement`` (``lpt_packing``'s packer), ``service`` (the KServe V2 service), ``scrape`` (the
workers' metrics), ``endpoints`` (DNS endpoints) and ``run`` (the actors; the standalone and the
embedded gateway)."""
