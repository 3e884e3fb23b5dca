"""Images as content: an OCI image store on NATS, a worker's cache, and safe unpacking.

The buyer's CLI pushes and imports images into the store; the exchange resolves an order's
reference to a manifest digest; a supplier prices what its cache lacks and prepares the
image's root before it runs a machine. Everything is named by digest (``sha256:<hex>``, the
SHA-256 of the stored bytes) and checked against it wherever bytes move (I7).

The store (``ImageStore``; one per subject prefix, on one NATS connection)::

    store = await ImageStore.open(nc, prefix, replicas=1)   # R3 on a cluster
    store = await ImageStore.open(nc, prefix, create=False) # a reader: makes no bucket
    await store.push_directory(Path("app/"), "web:v1", RunSpec(cmd=("./serve",), env=("A=1",)))
    await store.import_image(Path("busybox.tar"), "busybox:1.36")   # layout, oci-archive,
                                                                      # docker save
    await store.ls()                 # [TagInfo(reference, digest, size, created)]
    await store.inspect("web:v1")    # ImageInfo: cmd, entrypoint, env, workdir, user, layers
    await store.tag("web:v1", "web:stable")
    await store.remove_tag("web:stable")              # its blobs stay until gc
    await store.gc(in_use={...}, grace_s=3600)        # never a digest in use
    await store.fetch_blob(descriptor, dest_path)     # streamed, bounded, checked, renamed

Resolving a reference (``Reference.parse``: ``name[:tag]``, ``name@sha256:<hex>``): a
service keeps a ``TagIndex`` running in its task group (``await tg.start(index.run)``, with
``TagIndex(store.tags)``) and calls ``index.resolve(ref)`` per order: a dictionary lookup,
the KV watch keeps it current. A one-shot tool uses ``store.lookup(ref)`` (one KV read) or
``async with store.watch_tags() as index``.

A worker's cache (``ImageCache``; one per worker directory)::

    cache = ImageCache.open(directory, store, Limits(budget_bytes=20 << 30))
    cache.lacking(layers, manifest)   # bytes a pull would fetch (shared layers once): the price
    cache.stats().pull_bytes_per_s    # measured throughput: lacking / this = pull seconds
    cache.pin(manifest)               # a reserved or live machine uses it: never evicted
    root = await cache.prepare(manifest)   # fetched once, unpacked once, read-only root
    pulled = await cache.pull(manifest)    # the same, with the bytes it lacked, the seconds
                                           # and what the image runs (its config's command)
    cache.unpin(manifest)             # when the machine is destroyed
    cache.stats()                     # used, budget, hits, misses, pulled bytes, evictions

Modules: ``reference`` (the grammar, tag keys), ``oci`` (manifests, indexes, configs, media
types), ``build`` (a directory as a deterministic one-layer image), ``importer`` (what
docker, podman, skopeo and buildah write), ``store``, ``tags`` (``TagIndex``), ``unpack``
(layers into a root nothing escapes), ``policy`` (eviction and throughput, pure),
``cache``. Every error derives from ``ImageError`` (``bourse.errors.BourseError``).
"""

from bourse.images.build import RunSpec
from bourse.images.cache import ImageCache
from bourse.images.cachetypes import CacheStats
from bourse.images.errors import (
    BadImage,
    BadReference,
    CacheFull,
    DigestMismatch,
    ImageError,
    ImageNotFound,
    PullTimeout,
    StoreUnavailable,
    UnsafeEntry,
)
from bourse.images.oci import Descriptor
from bourse.images.policy import Limits
from bourse.images.reference import Reference
from bourse.images.store import ImageInfo, ImageStore, PushResult, TagInfo
from bourse.images.tags import TagIndex

__all__ = [
    "BadImage",
    "BadReference",
    "CacheFull",
    "CacheStats",
    "Descriptor",
    "DigestMismatch",
    "ImageCache",
    "ImageError",
    "ImageInfo",
    "ImageNotFound",
    "ImageStore",
    "Limits",
    "PullTimeout",
    "PushResult",
    "Reference",
    "RunSpec",
    "StoreUnavailable",
    "TagIndex",
    "TagInfo",
    "UnsafeEntry",
]
