#!/usr/bin/env bash
# A base image (Debian bookworm, Python 3.11) made from Debian packages, for machines that reach the
# package registries but no image registry: mmdebstrap builds the root, `docker import` makes it an image.
# Usage: docker/base.sh TAG   (nothing is done when TAG exists; `docker rmi TAG` to make it again)
set -euo pipefail
tag=${1:?usage: docker/base.sh TAG}
if docker image inspect "$tag" >/dev/null 2>&1; then exit 0; fi
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# mmdebstrap's helpers (mmtarfilter, run once a package) are Debian's `#!/usr/bin/env python3` scripts: Debian's
# own python3 first, not a pyenv shim or venv in front of PATH (a shim costs ~2 s a call on a loaded machine)
PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
  --aptopt='APT::Install-Recommends "false"' \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  bookworm "$tmp/root.tar" \
  "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
  "deb ${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main"
docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["/bin/bash"]' "$tmp/root.tar" "$tag" >/dev/null
echo "docker/base.sh: made $tag (Debian bookworm, by mmdebstrap)"
