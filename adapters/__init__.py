"""Our gate on other libraries' models (DESIGN.md, rooms: adapters): each splits the other
library's forward into probe / middle / tail on its own layers and drives it as our loop does."""
