/**
 * Who holds the ports of a refused restore, from the server's error: the notebook's own
 * kernel, another kernel of the server (named by its notebook), or something else; and,
 * before any restore is asked for, whether the notebook's own kernel holds them.
 */
import { type IJobError, type ISnapshotSummary, SnapshotAPIError } from './api';
import { untranslated } from './translation';

export type PortsHolder =
  | { kind: 'this-kernel' }
  | { kind: 'other-kernel'; kernelId: string; path: string | null; owner: string }
  | { kind: 'outside' };

/** Null unless the error is a refusal for taken ports (error code ports_in_use). */
export function portsHolder(
  error: IJobError | null,
  ownKernelId: string | null,
  trans = untranslated
): PortsHolder | null {
  if (error?.code !== 'ports_in_use') {
    return null;
  }
  const holder = error.details?.holder_kernel_id ?? null;
  if (!holder) {
    return { kind: 'outside' };
  }
  if (holder === ownKernelId) {
    return { kind: 'this-kernel' };
  }
  const path = error.details?.holder_notebook_path ?? null;
  const owner = path ? path.split('/').pop() || path : trans.__('kernel %1', holder);
  return { kind: 'other-kernel', kernelId: holder, path, owner };
}

/** The notebook's running kernel, and the snapshot it was restored from, when known. */
export interface IRunningKernel {
  kernelId: string | null;
  originId: string | null;
}

/** The ports a snapshot's kernel listened on, as one key; null when it does not say. */
function portsKey(snapshot: ISnapshotSummary | undefined): string | null {
  const info = snapshot?.kernel?.connection_info;
  if (!info) {
    return null;
  }
  const ports = Object.keys(info)
    .filter(key => key.endsWith('_port'))
    .sort()
    .map(key => `${key}=${String(info[key])}`);
  return ports.length ? `${String(info.ip ?? '')}:${ports.join(',')}` : null;
}

/**
 * Whether the notebook's running kernel holds the ports ``snapshot`` would listen on, so
 * that restoring it means replacing that kernel: a snapshot of that kernel, the one it
 * was restored from, or another of the same line (taken of the kernel it came from, or
 * of another kernel restored from that one): they all listen where its origin did.
 */
export function heldByRunningKernel(
  snapshot: ISnapshotSummary,
  running: IRunningKernel,
  listing: readonly ISnapshotSummary[] = []
): boolean {
  const { kernelId, originId } = running;
  if (
    (kernelId !== null && snapshot.kernel?.kernel_id === kernelId) ||
    snapshot.id === originId
  ) {
    return true;
  }
  const own =
    listing.find(s => s.id === originId) ??
    (kernelId !== null ? listing.find(s => s.kernel?.kernel_id === kernelId) : undefined);
  const ports = portsKey(own);
  return ports !== null && ports === portsKey(snapshot);
}

/**
 * Why the server refused to change a snapshot (a delete, a rename), in a user's words
 * where its error code says more than its text: what holds a busy snapshot, not the id of
 * the job that does. Else the server's own message.
 */
export function describeRefusal(error: unknown, trans = untranslated): string {
  const refusal = error instanceof SnapshotAPIError ? error.error : null;
  if (refusal?.code === 'busy' && refusal.details?.in_use_by) {
    const holders: { [kind: string]: string } = {
      restore: trans.__('it is being restored; try again once the restore has ended'),
      upload: trans.__('it is being uploaded; try again once the upload has ended'),
      save: trans.__('it is being saved; try again once the save has ended'),
      hibernation: trans.__(
        'a hibernated kernel wakes from it; wake that kernel or shut it down first'
      )
    };
    return (
      holders[refusal.details.in_use_by] ??
      trans.__('it is in use; try again once that has ended')
    );
  }
  if (refusal?.code === 'invalid_request' || refusal?.code === 'busy') {
    return refusal.cause; // what was wrong, without "rename failed:"
  }
  return (error as Error).message;
}
