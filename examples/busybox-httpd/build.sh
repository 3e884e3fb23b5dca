#!/bin/sh
# Build a root of its own for a container: a static busybox, its applets as links, and a
# web root that busybox's httpd serves on $PORT (/ a page, /healthz "ok").
#   examples/busybox-httpd/build.sh DIR
#   bourse image push busybox-httpd:latest DIR --cmd 'sh -c "exec httpd -f -p $PORT -h /www"'
# Needs a statically linked busybox (Debian: busybox-static); BUSYBOX names another one.
set -eu
out=${1:?usage: build.sh DIR}
busybox=${BUSYBOX:-$(command -v busybox || true)}
if [ -z "$busybox" ] || ! "$busybox" true 2>/dev/null; then
    echo "build.sh: no busybox: install busybox-static (or set BUSYBOX)" >&2
    exit 1
fi
if ldd "$busybox" >/dev/null 2>&1; then
    echo "build.sh: $busybox is linked dynamically: install busybox-static (or set BUSYBOX)" >&2
    exit 1
fi
mkdir -p "$out/bin" "$out/www" "$out/tmp" "$out/etc"
chmod 1777 "$out/tmp"
cp "$busybox" "$out/bin/busybox"
for applet in $("$busybox" --list); do
    [ "$applet" = busybox ] || ln -sf busybox "$out/bin/$applet"
done
echo 'root:x:0:0:root:/:/bin/sh' > "$out/etc/passwd"
echo 'nobody:x:65534:65534:nobody:/:/bin/sh' >> "$out/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$out/etc/group"
echo '<h1>hello from busybox httpd, in a root of its own</h1>' > "$out/www/index.html"
echo ok > "$out/www/healthz"
