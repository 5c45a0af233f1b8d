/**
 * The server extension's REST API (jupyter_gpu_snapshot/server/openapi.yaml), typed.
 *
 * Every call goes through ServerConnection, so the token, the XSRF cookie and the
 * server's base URL are handled the way the rest of JupyterLab handles them.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import type { TranslationBundle } from '@jupyterlab/translation';
import { untranslated } from './translation';

/** The kernelspec of snapshot-ready kernels, which the package installs. */
export const SNAPSHOT_KERNEL_NAME = 'python3-snapshot';

export type Phase =
  | 'preflight'
  | 'suspend'
  | 'dump'
  | 'resume'
  | 'commit'
  | 'uploading'
  | 'downloading'
  | 'verify'
  | 'restore'
  | 'fallback'
  | 'done';

export interface ISnapshotSummary {
  id: string;
  name: string;
  /** Seconds since the epoch. */
  created: number;
  created_iso: string;
  /** The images as a restore gets them. */
  size_bytes: number;
  /**
   * What its save wrote to the store (pages shared with other snapshots not counted
   * again); servers from before the content-addressed store leave it out.
   */
  new_bytes?: number;
  host: string | null;
  /** The notebook it belongs to: where that notebook is now, renames followed. */
  notebook_path: string | null;
  /** Where that notebook was when the snapshot was saved (older servers leave it out). */
  saved_notebook_path?: string | null;
  kernel: {
    name?: string;
    kernel_id?: string;
    /** Ports and transport, the key left out: a restore listens on these again. */
    connection_info?: { [key: string]: unknown };
    [key: string]: unknown;
  };
  /** Why it was taken; servers may add kinds (autosave). */
  reason: 'user' | 'shutdown' | 'autosave' | string;
  timings: { [key: string]: number };
  gpu: { [key: string]: unknown } | null;
  /** Where it is kept; servers without a remote store leave it out. */
  location?: 'local' | 'remote' | 'both';
  /**
   * What it offers if its process image cannot come back (see FallbackMode); older
   * servers and snapshots leave it out or list none.
   */
  fallback?: FallbackMode[];
  /** The count of the last cell the kernel ran before the save, when it recorded them. */
  execution_count?: number | null;
}

/**
 * A way back into a fresh kernel when a snapshot's image cannot be restored: load its
 * portable copy of the namespace, re-run the cells the kernel ran, or load the copy and
 * re-run only the cells that built the names it lacks.
 */
export type FallbackMode = 'portable' | 'replay' | 'both';

/** What a fallback restore brought back (the finished job's ``result.fallback``). */
export interface IFallbackReport {
  mode: string;
  loaded: { name: string; kind: string; device: string; note?: string }[];
  not_loaded: { name: string; reason: string }[];
  replayed: { count: number; status: 'ok' | 'error'; error?: string }[];
  notes: string[];
}

/** The server's error kinds (server/openapi.yaml, Error.code): branch on these, not on text. */
export type ErrorCode =
  | 'failed'
  | 'invalid_request'
  | 'forbidden'
  | 'not_found'
  | 'busy'
  | 'not_ready'
  | 'ports_in_use'
  | 'incompatible_node'
  | 'kernel_busy'
  | 'rewind_out_of_range'
  | 'rewind_failed'
  | 'no_answer';

export interface ISnapshotListing {
  snapshots: ISnapshotSummary[];
  store?: { path: string; free_bytes: number | null };
}

export interface IJobError {
  code?: ErrorCode;
  details?: {
    ports?: string[];
    holder_kernel_id?: string | null;
    holder_notebook_path?: string | null;
    /** What the snapshot offers instead, when its image was refused or failed to restore. */
    fallback?: FallbackMode[];
    /** A busy snapshot: what holds it (a job's kind, or hibernation) and the job. */
    in_use_by?: string;
    job_id?: string;
    [key: string]: unknown;
  };
  step: string;
  cause: string;
  hint?: string | null;
  log?: string | null;
  message: string;
}

export interface IRestoreResult {
  kernel_id: string;
  session_id: string | null;
  /** A restore with ``fallback``: what came back into the fresh kernel. */
  fallback?: IFallbackReport;
}

export interface IJob {
  id: string;
  /** 'upload': a retried upload of a saved snapshot; it has no kernel, so no panel shows it. */
  kind: 'save' | 'restore' | 'upload' | 'wake';
  kernel_id: string | null;
  snapshot_id: string | null;
  status: 'running' | 'succeeded' | 'failed';
  phase: Phase;
  done: number;
  total: number;
  started: number;
  finished: number | null;
  result: ISnapshotSummary | IRestoreResult | null;
  error: IJobError | null;
  /** Why a save runs (user, autosave, shutdown); servers before autosave leave it out. */
  reason?: string;
}

/** The autosave settings in force for a notebook (openapi.yaml, AutosavePolicy). */
export interface IAutosavePolicy {
  enabled: boolean;
  interval_minutes: number;
  after_cell_minutes: number;
  during_cell: boolean;
  /** Minutes of idleness after which the kernel hibernates (0: never); newer servers. */
  hibernate_after_minutes?: number;
  /** Minutes of idleness after which it gives its GPU back (0: never); newer servers. */
  release_gpu_after_minutes?: number;
}

/** Hibernation's tiers: the GPU released with the process kept, or the process saved. */
export type HibernationTier = 'gpu' | 'process';

/** The policy field that says after how long idle a kernel hibernates in each tier. */
export const IDLE_POLICY_FIELDS = {
  gpu: 'release_gpu_after_minutes',
  process: 'hibernate_after_minutes'
} as const satisfies { [tier in HibernationTier]: keyof IAutosavePolicy };

/** What a notebook overrides; null puts a field back to the server's setting. */
export type AutosaveOverride = {
  [K in keyof IAutosavePolicy]?: IAutosavePolicy[K] | null;
};

/**
 * The override of a tier's idle time that the sidebar's form asks for: ``minutes`` in
 * mode 'after', 0 in mode 'never', null (the server's setting) in mode 'default';
 * undefined when the minutes are no number above 0.
 */
export function idleOverride(
  tier: HibernationTier,
  mode: string,
  minutes: number
): AutosaveOverride | undefined {
  if (mode === 'after' && !(minutes > 0)) {
    return undefined;
  }
  const value = mode === 'default' ? null : mode === 'never' ? 0 : minutes;
  return { [IDLE_POLICY_FIELDS[tier]]: value };
}

/** A kernel's autosave state (openapi.yaml, AutosaveState). */
export interface IAutosaveState {
  kernel_id: string;
  notebook_path: string | null;
  policy: IAutosavePolicy;
  override: AutosaveOverride;
  unsaved_work: boolean;
  /** Seconds since the epoch; null when off or nothing ran since the last snapshot. */
  next_autosave: number | null;
  autosaving: boolean;
  last_autosave: {
    snapshot_id: string;
    created: number;
    pause: number | null;
    size_bytes: number | null;
  } | null;
  last_skip: string | null;
}

/**
 * How a kernel of the slot died (openapi.yaml, KernelDeath): branch on ``code``, never on
 * ``cause``, which is the same in English.
 */
export interface IKernelDeath {
  /** When the server noticed it, seconds since the epoch. */
  at: number;
  code: 'signal' | 'exit' | 'unknown';
  cause: string | null;
  signal: number | null;
  signal_name: string | null;
  exit_status: number | null;
  /** Whether a blank kernel now runs in the slot. */
  restarted: boolean;
  notebook_path: string | null;
  /** The newest snapshot of the kernel or its notebook, when it died. */
  snapshot: { id: string; name: string; created: number } | null;
}

/** A kernel's hibernation (openapi.yaml, Hibernation). */
export interface IHibernation {
  kernel_id: string;
  state: 'requested' | 'hibernating' | 'hibernated' | 'waking';
  /** gpu: the GPU released, the process kept; process: saved and ended (older servers). */
  tier?: HibernationTier;
  notebook_path?: string | null;
  /** GPU memory the kernel held, free since it hibernated (0 before). */
  gpu_bytes_freed?: number;
  /** Host memory given back: the process tier only (0 in the gpu tier). */
  host_bytes_freed?: number;
  gpu_bytes?: number;
  host_bytes?: number;
  /** When its process ended, seconds since the epoch. */
  since?: number | null;
  snapshot_id?: string | null;
  job_id?: string | null;
  last_wake_error?: IJobError | null;
}

export interface IKernelStatus {
  kernel_id: string;
  ready: boolean;
  reasons: string[];
  kernel_name: string;
  cuda: { state: string; memory_bytes: number; [key: string]: unknown } | null;
  last_snapshot: ISnapshotSummary | null;
  job: IJob | null;
  /** The slot's last kernel death the user has not dismissed; older servers leave it out. */
  death?: IKernelDeath | null;
  /** The kernel's hibernation, while there is one; older servers leave it out. */
  hibernation?: IHibernation | null;
  /** The server's criu; null where the node agent runs it, left out by older servers. */
  criu?: ICriuFill | null;
  /**
   * Its save when the server stops (snapshot_on_shutdown): the time it would take now,
   * from the rates of past saves, and whether that fits the server's budget. Null when
   * no save would be made; older servers leave it out.
   */
  shutdown_save?: IShutdownSave | null;
}

/** Which criu restores on the server: ours fills memory on several CPUs, stock is slower. */
export interface ICriuFill {
  version: string | null;
  /** null: a criu the install did not build, not known. */
  fast_fill: boolean | null;
  detail: string;
}

/** A kernel's save at shutdown, as its status estimates it. */
export interface IShutdownSave {
  seconds: number;
  budget: number;
  fits: boolean;
}

/** What the store takes on disk (GET usage): pages shared by snapshots count once. */
export interface IStoreUsage {
  disk_bytes: number;
}

/** A name a timeline point could not copy, or a rewind could not put back, and why. */
export interface IUncopiedName {
  name: string;
  reason: string;
}

/** One point of a kernel's timeline: the state after the cell that ran as In [count]. */
export interface ITimelinePoint {
  count: number;
  /** False: the cell raised (its changes up to the error are recorded). */
  ok: boolean;
  /** The names the cell bound or mutated, as far as the timeline sees. */
  changed: string[];
  deleted: string[];
  /** What this point's copies hold. */
  bytes: number;
  uncopied: IUncopiedName[];
  /** When the cell ended, seconds since the epoch. */
  at: number;
}

/** A kernel's timeline (GET kernels/{id}/timeline). */
export interface ITimeline {
  /** Whether the kernel keeps a timeline (off unless asked for); off, it has no points. */
  on?: boolean;
  /** A cell runs now: no rewind until it ends. */
  running: boolean;
  /** Oldest first. */
  points: ITimelinePoint[];
  /** The counts N for which "rewind to before N" is possible now. */
  rewindable: number[];
  /** The timeline's host memory, and its limit. */
  bytes: number;
  limit_bytes: number;
  /** Oldest points dropped for the limit. */
  dropped: number;
}

/** What a rewind did (POST kernels/{id}/rewind). */
export interface IRewindReport {
  before: number;
  /** The counts of the cells whose effects are gone. */
  undone: number[];
  /** Names put back as they were. */
  restored: string[];
  /** Names that did not exist then, deleted. */
  removed: string[];
  not_restored: IUncopiedName[];
  /** What no rewind undoes (files on disk, other modules' globals, unseen mutations). */
  caveats: string[];
}

/** An error answer of the API, carrying the server's own message and error object. */
export class SnapshotAPIError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly error: IJobError | null = null
  ) {
    super(message);
  }
}

export class SnapshotAPI {
  constructor(
    readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings(),
    private readonly _trans: TranslationBundle = untranslated
  ) {}

  async listSnapshots(notebookPath?: string): Promise<ISnapshotSummary[]> {
    return (await this.listing(notebookPath)).snapshots;
  }

  /** The snapshots and, from servers that tell, the store's free disk space. */
  listing(notebookPath?: string): Promise<ISnapshotListing> {
    const query = notebookPath
      ? URLExt.objectToQueryString({ notebook_path: notebookPath })
      : '';
    return this._request<ISnapshotListing>('snapshots' + query);
  }

  /**
   * The newest snapshot of each notebook (of ``notebookPath`` alone when given), whatever
   * its reason: what a restarted server offers back. Newest first.
   */
  async latestSnapshots(notebookPath?: string): Promise<ISnapshotSummary[]> {
    const query = URLExt.objectToQueryString({
      latest: 'true',
      ...(notebookPath ? { notebook_path: notebookPath } : {})
    });
    return (await this._request<ISnapshotListing>('snapshots' + query)).snapshots;
  }

  /** Give a snapshot another name (PATCH snapshots/{id}); the renamed summary. */
  renameSnapshot(id: string, name: string): Promise<ISnapshotSummary> {
    return this._request<ISnapshotSummary>('snapshots/' + encodeURIComponent(id), {
      method: 'PATCH',
      body: JSON.stringify({ name })
    });
  }

  getSnapshot(id: string): Promise<ISnapshotSummary> {
    return this._request<ISnapshotSummary>('snapshots/' + encodeURIComponent(id));
  }

  /** What the store takes on disk, shared pages counted once (GET usage). */
  usage(): Promise<IStoreUsage> {
    return this._request<IStoreUsage>('usage');
  }

  /** Forget the kernel's death record (DELETE kernels/{id}/death). */
  async dismissDeath(kernelId: string): Promise<void> {
    await this._request(`kernels/${encodeURIComponent(kernelId)}/death`, {
      method: 'DELETE'
    });
  }

  /** The server's hibernated kernels (GET hibernation). */
  async hibernation(): Promise<IHibernation[]> {
    return (await this._request<{ kernels: IHibernation[] }>('hibernation')).kernels;
  }

  /** Wake a hibernated kernel now (POST kernels/{id}/wake). */
  wake(kernelId: string): Promise<IHibernation> {
    return this._request<IHibernation>(`kernels/${encodeURIComponent(kernelId)}/wake`, {
      method: 'POST'
    });
  }

  /** Hibernate the kernel once its running cell has ended (POST kernels/{id}/hibernate). */
  hibernate(kernelId: string): Promise<IHibernation> {
    return this._request<IHibernation>(
      `kernels/${encodeURIComponent(kernelId)}/hibernate`,
      {
        method: 'POST',
        body: JSON.stringify({ when_idle: true })
      }
    );
  }

  async deleteSnapshot(id: string): Promise<void> {
    await this._request('snapshots/' + encodeURIComponent(id), {
      method: 'DELETE'
    });
  }

  startSave(
    kernelId: string,
    options: { name?: string; stop?: boolean; portable?: boolean } = {}
  ): Promise<IJob> {
    return this._request<IJob>(`kernels/${encodeURIComponent(kernelId)}/snapshots`, {
      method: 'POST',
      body: JSON.stringify(options)
    });
  }

  startRestore(
    snapshotId: string,
    options: { path?: string; session_id?: string; fallback?: FallbackMode }
  ): Promise<IJob> {
    return this._request<IJob>(`snapshots/${encodeURIComponent(snapshotId)}/restore`, {
      method: 'POST',
      body: JSON.stringify(options)
    });
  }

  getJob(jobId: string): Promise<IJob> {
    return this._request<IJob>('jobs/' + encodeURIComponent(jobId));
  }

  kernelStatus(kernelId: string): Promise<IKernelStatus> {
    return this._request<IKernelStatus>(`kernels/${encodeURIComponent(kernelId)}/status`);
  }

  autosave(kernelId: string): Promise<IAutosaveState> {
    return this._request<IAutosaveState>(
      `kernels/${encodeURIComponent(kernelId)}/autosave`
    );
  }

  setAutosave(kernelId: string, override: AutosaveOverride): Promise<IAutosaveState> {
    return this._request<IAutosaveState>(
      `kernels/${encodeURIComponent(kernelId)}/autosave`,
      {
        method: 'PUT',
        body: JSON.stringify(override)
      }
    );
  }

  /** The kernel's timeline: a point per cell, and which cells it can go back to before. */
  timeline(kernelId: string): Promise<ITimeline> {
    return this._request<ITimeline>(`kernels/${encodeURIComponent(kernelId)}/timeline`);
  }

  /** Put the kernel back to how it was before the cell that ran as In [before]. */
  async rewind(kernelId: string, before: number): Promise<IRewindReport> {
    const answer = await this._request<{ report: IRewindReport }>(
      `kernels/${encodeURIComponent(kernelId)}/rewind`,
      { method: 'POST', body: JSON.stringify({ before }) }
    );
    return answer.report;
  }

  private async _request<T>(endpoint: string, init: RequestInit = {}): Promise<T> {
    const url = URLExt.join(this.settings.baseUrl, 'gpu-snapshot', endpoint);
    let response: Response;
    try {
      response = await ServerConnection.makeRequest(url, init, this.settings);
    } catch (error) {
      throw new SnapshotAPIError(
        this._trans.__('cannot reach the Jupyter server: %1', (error as Error).message),
        0
      );
    }
    const text = await response.text();
    let data: any = null;
    if (text) {
      try {
        data = JSON.parse(text);
      } catch {
        data = null;
      }
    }
    if (!response.ok) {
      const message =
        (data && typeof data.message === 'string' && data.message) ||
        (response.status === 404 && !data
          ? this._trans.__(
              'the gpu-snapshot server extension is not enabled on this server'
            )
          : `${response.status} ${response.statusText}`);
      const error = data && typeof data.step === 'string' ? (data as IJobError) : null;
      throw new SnapshotAPIError(message, response.status, error);
    }
    return data as T;
  }
}
