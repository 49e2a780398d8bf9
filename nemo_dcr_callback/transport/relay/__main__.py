"""`python -m nemo_dcr_callback.transport.relay PARENT [--port N]`: a relay without the CLI."""

import sys

from nemo_dcr_callback.transport.relay.node import main

sys.exit(main())
