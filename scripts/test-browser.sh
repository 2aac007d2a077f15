#!/usr/bin/env bash
# The chat page in a real browser: headless Chromium (Debian's chromium and chromium-driver)
# driven by selenium against `legato serve`. Installs what it needs, then runs the tests
# marked `browser` (deselected from scripts/test.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
VENV=${LEGATO_VENV:-.venv}
if [[ ! -x /usr/bin/chromium || ! -x /usr/bin/chromedriver ]]; then
    SUDO=$([[ $(id -u) -eq 0 ]] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium chromium-driver
fi
"$VENV/bin/python" -c "import selenium" 2>/dev/null ||
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[browser]"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false SE_OFFLINE=true
exec "$VENV/bin/python" -m pytest -m browser tests/browser "$@"
