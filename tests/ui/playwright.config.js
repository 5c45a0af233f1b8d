// Galata's Playwright defaults for JupyterLab, driving the system chromium (no browser is
// downloaded) against a server that test_lab_ui.py has started. pytest sets:
//   LAB_URL     the server's base URL          LAB_TOKEN  its token
//   ARTIFACTS   the artifacts' folder: a folder per scenario for its step screenshots
//               and what it saw (seen.json)
//   CHROMIUM    the browser (default /usr/bin/chromium)
// and passes --output (Playwright's own artifacts) and --grep (one scenario per run).
const path = require('node:path');
const galataConfig = require('@jupyterlab/galata/lib/playwright-config');

const token = process.env.LAB_TOKEN;
const artifacts =
  process.env.ARTIFACTS ?? path.join(__dirname, '../../test-artifacts/ui');

module.exports = {
  ...galataConfig,
  testDir: './specs',
  // Beside the step screenshots (pytest gives each scenario its own with --output).
  outputDir: path.join(artifacts, 'playwright'),
  // A scenario waits on real kernels and real CRIU; pytest holds the overall limit.
  timeout: 240_000,
  expect: { timeout: 60_000 },
  // The servers are pytest's, one at a time (the machines running these have few cores).
  workers: 1,
  fullyParallel: false,
  retries: 0,
  forbidOnly: true,
  reporter: [
    ['list'],
    [
      'json',
      {
        outputFile:
          process.env.PLAYWRIGHT_JSON_OUTPUT_NAME ??
          path.join(artifacts, 'playwright', 'report.json')
      }
    ]
  ],
  use: {
    ...galataConfig.use,
    // Galata joins the base URL and the app path ('/lab'): no trailing slash.
    baseURL: (process.env.LAB_URL ?? 'http://127.0.0.1:8888').replace(/\/+$/, ''),
    // The token authenticates the page, its requests and websockets, and the `request`
    // fixture; the server keeps its token and XSRF checks.
    extraHTTPHeaders: token ? { Authorization: `token ${token}` } : {},
    viewport: { width: 1366, height: 820 },
    launchOptions: {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync'
      ]
    },
    // Our own screenshot at each step goes to ARTIFACTS; Playwright adds the last one.
    screenshot: 'on',
    video: 'off',
    trace: 'retain-on-failure',
    // Galata's options: the page opens the scenario's notebook itself, and the settings
    // stay in memory (no news or update notifications over the screenshots).
    autoGoto: false,
    mockSettings: {
      '@jupyterlab/apputils-extension:notification': {
        checkForUpdates: false,
        fetchNews: 'false'
      }
    }
  }
};
