"""Operations: retention, idle release of staging memory, status and metrics, the NVMe root's identity."""
